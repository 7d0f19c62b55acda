"""Regenerate ``synthetic_stories.txt``, the English corpus the builtin tiny model trains on.

The corpus is synthetic on purpose: it is the project's own work (Apache-2.0, no third-party
licence to track), it is varied enough (stories, letters, weather reports, recipes, dialogues)
for a byte-level BPE tokenizer and a small language model to learn real structure from, and it
is reproducible byte for byte from the fixed seed below. Run it from the repository root:

    python -m airflow_provider_spotsched.data.text.generate_corpus
"""

from __future__ import annotations

import random
from pathlib import Path

SEED = 2026
TARGET_CHARS = 240_000
OUTPUT = Path(__file__).with_name("synthetic_stories.txt")

NAMES = ["Anna", "Ben", "Clara", "David", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kira",
         "Leo", "Maya", "Nils", "Olga", "Paul", "Rosa", "Sam", "Tara", "Victor", "Wendy", "Yusuf"]
ANIMALS = ["fox", "owl", "dog", "cat", "goat", "horse", "rabbit", "crow", "bear", "duck", "mouse"]
PLACES = ["the old mill", "the river bank", "the market square", "the forest edge", "the harbour",
          "the hill above the village", "the library", "the bakery", "the train station", "the garden"]
OBJECTS = ["a red kite", "a wooden box", "a silver key", "a map", "a loaf of bread", "a lantern",
           "a letter", "a blue umbrella", "a basket of apples", "a small boat", "a compass", "a clock"]
ADJECTIVES = ["quiet", "bright", "cold", "warm", "windy", "gentle", "strange", "busy", "long", "calm"]
FEELINGS = ["happy", "tired", "curious", "worried", "proud", "surprised", "hungry", "brave"]
TIMES = ["In the morning", "At noon", "In the evening", "Late at night", "Before dawn", "After lunch"]
WEATHER = ["sunny", "cloudy", "rainy", "foggy", "snowy", "stormy", "clear", "windy"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
FOODS = ["flour", "butter", "sugar", "eggs", "milk", "salt", "apples", "onions", "carrots", "rice"]
VERBS_PAST = ["found", "lost", "carried", "painted", "opened", "repaired", "hid", "shared", "sold"]


def story(rng: random.Random) -> str:
    hero, friend = rng.sample(NAMES, 2)
    animal, place, thing = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(OBJECTS)
    lines = [
        f"{rng.choice(TIMES)}, {hero} walked to {place}.",
        f"The day was {rng.choice(ADJECTIVES)} and the sky was {rng.choice(WEATHER)}.",
        f"Near the path a {animal} was watching {hero} with {rng.choice(ADJECTIVES)} eyes.",
        f"{hero} {rng.choice(VERBS_PAST)} {thing} and felt {rng.choice(FEELINGS)}.",
        f"Then {friend} came along and asked, \"What do you have there, {hero}?\"",
        f"\"It is {thing},\" said {hero}. \"I {rng.choice(VERBS_PAST)} it at {rng.choice(PLACES)}.\"",
        f"{friend} smiled, and the two of them went home before the sun went down.",
    ]
    keep = sorted(rng.sample(range(len(lines)), rng.randint(4, len(lines))))
    return " ".join(lines[i] for i in keep)


def weather_report(rng: random.Random) -> str:
    day, sky = rng.choice(DAYS), rng.choice(WEATHER)
    low = rng.randint(-5, 15)
    high = low + rng.randint(2, 12)
    wind = rng.randint(0, 60)
    return (f"Weather for {day}: {sky} skies, a low of {low} degrees and a high of {high} degrees. "
            f"Wind from the {rng.choice(['north', 'south', 'east', 'west'])} at {wind} kilometres per hour. "
            f"{'Take an umbrella.' if sky in ('rainy', 'stormy') else 'A good day to be outside.'}")


def recipe(rng: random.Random) -> str:
    items = rng.sample(FOODS, rng.randint(3, 5))
    steps = [f"{i + 1}. Take {rng.randint(1, 5)} cups of {item}." for i, item in enumerate(items)]
    return (f"Recipe for {rng.choice(ADJECTIVES)} {rng.choice(['soup', 'cake', 'bread', 'pie', 'stew'])}. "
            + " ".join(steps)
            + f" Mix everything, cook for {rng.randint(10, 90)} minutes"
            + f" and serve {rng.choice(['hot', 'cold', 'warm'])}.")


def letter(rng: random.Random) -> str:
    sender, reader = rng.sample(NAMES, 2)
    return (f"Dear {reader}, I hope you are well. Here it has been {rng.choice(WEATHER)} all week. "
            f"On {rng.choice(DAYS)} I visited {rng.choice(PLACES)} and saw a {rng.choice(ANIMALS)}. "
            f"Please bring {rng.choice(OBJECTS)} when you come. With love, {sender}.")


def counting(rng: random.Random) -> str:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    animal = rng.choice(ANIMALS)
    return (f"There were {a} {animal}s in the field and {b} more came. "
            f"Now there are {a + b} {animal}s in the field.")


KINDS = [(story, 5), (weather_report, 2), (recipe, 2), (letter, 2), (counting, 1)]


def generate(seed: int = SEED, target_chars: int = TARGET_CHARS) -> str:
    """The corpus text: paragraphs of every kind, drawn by weight, until ``target_chars``."""
    rng = random.Random(seed)
    kinds = [kind for kind, weight in KINDS for _ in range(weight)]
    paragraphs: list[str] = []
    size = 0
    while size < target_chars:
        paragraph = rng.choice(kinds)(rng)
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(generate(), encoding="utf-8")
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")
