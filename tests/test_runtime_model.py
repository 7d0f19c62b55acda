"""The builtin tiny GPT-2 and its tokenizer are built from the shipped text, deterministically."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from airflow_provider_spotsched.runtime.config import LoraSettings
from airflow_provider_spotsched.runtime.data import load_text
from airflow_provider_spotsched.runtime.model import TINY_GPT2, build_tiny_gpt2, resolve_model, tiny_gpt2_dir, wrap_lora
from tests.runtime_support import environment

# peft (0.21) still calls transformers' deprecated is_gradient_checkpointing
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def test_two_builds_give_the_same_tokenizer_and_weights(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    build_tiny_gpt2(first)
    build_tiny_gpt2(second)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    model_a = AutoModelForCausalLM.from_pretrained(first)
    model_b = AutoModelForCausalLM.from_pretrained(second)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name
    assert model_a.config.n_layer == TINY_GPT2["n_layer"] and model_a.config.n_embd == TINY_GPT2["n_embd"]
    tokenizer = AutoTokenizer.from_pretrained(first)
    # the synthetic corpus runs out of pairs worth merging before the 2,000-token cap
    assert len(tokenizer) == model_a.config.vocab_size <= TINY_GPT2["vocab_size"]
    sentence = "Anna walked to the old mill."
    assert tokenizer.decode(tokenizer(sentence)["input_ids"]) == sentence
    text = load_text("builtin:synthetic-stories")
    assert len(tokenizer(text[:5000])["input_ids"]) < 5000 / 2.5  # BPE merges learnt from the corpus


def test_the_builtin_model_is_built_once_into_the_cache(tmp_path):
    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path)):
        source = resolve_model("builtin:tiny-gpt2")
        assert source == str(tiny_gpt2_dir()) and source.startswith(str(tmp_path))
        stamp = (tmp_path / source / "config.json").stat().st_mtime_ns
        assert resolve_model("builtin:tiny-gpt2") == source
        assert (tmp_path / source / "config.json").stat().st_mtime_ns == stamp
        assert resolve_model("/some/local/model") == "/some/local/model"
        with pytest.raises(ValueError, match="is not a builtin model"):
            resolve_model("builtin:llama")
        model = wrap_lora(AutoModelForCausalLM.from_pretrained(source), LoraSettings(r=4), "builtin:tiny-gpt2")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == {"c_attn", "c_proj", "c_fc"}


def test_an_incomplete_cached_build_is_replaced(tmp_path):
    # A cache damaged outside the build (here: the model files gone, the tokenizer left) is not
    # taken for a build, nor left in the way of one.
    with environment(SPOTSCHED_CACHE_DIR=str(tmp_path)):
        directory = tiny_gpt2_dir()
        directory.mkdir(parents=True)
        (directory / "tokenizer.json").write_text("{}")
        source = resolve_model("builtin:tiny-gpt2")
    assert source == str(directory)
    assert AutoModelForCausalLM.from_pretrained(directory).config.n_layer == TINY_GPT2["n_layer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [directory.name]  # nothing moved aside is left


BUILD_AS_RANK = """
import sys
from pathlib import Path
import torch.distributed as dist
from airflow_provider_spotsched.runtime.model import build_tiny_gpt2, is_complete
rank, store, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
build_tiny_gpt2(out)
print(is_complete(out))
dist.destroy_process_group()
"""


def test_every_rank_of_a_distributed_job_builds_a_complete_model(tmp_path):
    # The workers of a multi-process job join their process group before they load the model, and
    # any of them may be the first to build the cache; transformers' save_pretrained writes nothing
    # on ranks other than 0 of an initialised group.
    workers = [
        subprocess.Popen([sys.executable, "-c", BUILD_AS_RANK, str(rank), str(tmp_path / "store"), str(tmp_path / f"rank-{rank}")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    results = [worker.communicate(timeout=240) for worker in workers]
    for worker, (out, err) in zip(workers, results):
        assert worker.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "True"
    first, second = (AutoModelForCausalLM.from_pretrained(tmp_path / f"rank-{rank}") for rank in range(2))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
