"""The fleet dashboard in a real browser: served by uvicorn, authenticated by the UI's cookie.

As :mod:`tests.test_report_browser` does for the run report: the plugin app behind uvicorn with
Airflow's auth, on the deployment of :mod:`tests.fleet_airflow`; headless Chromium gets the
``_token`` cookie, loads ``/spotsched/fleet`` and captures the whole page, which must hold the
fleet's charts and not be blank. Chromium is a system package; without it this test fails.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from tests.fleet_airflow import DAG_A, DAG_B, shared_fleet_db
from tests.fleet_samples import CONTEXTS
from tests.headless_chromium import PageCapture, capture_page, chromium  # noqa: F401 (a fixture)
from tests.report_airflow import serve_over_http, serve_reports, token

WIDTH = 1280
CHARTS = 2 + len(CONTEXTS)  # savings over time, preemptions per pool and region, one per kind of job


@pytest.fixture(scope="module")
def fleet_url(tmp_path_factory) -> Iterator[str]:
    """The fleet page, served by uvicorn on a free local port."""
    from airflow.models.crypto import get_fernet

    db = shared_fleet_db(tmp_path_factory)
    with serve_reports(db) as host:
        get_fernet.cache_clear()  # the deployment's Fernet key decrypts the selector's Variable
        try:
            with serve_over_http(host) as base_url:
                yield f"{base_url}/spotsched/fleet"
        finally:
            get_fernet.cache_clear()


@pytest.fixture(scope="module")
def signed_in(chromium, fleet_url, tmp_path_factory) -> PageCapture:
    return capture_page(chromium, fleet_url, tmp_path_factory.mktemp("chromium-fleet"),
                        cookies={"_token": token("viewer", "viewer")}, width=WIDTH)


def test_the_browser_renders_the_whole_fleet(signed_in):
    for text in ("Spot fleet", "Saved against on-demand", "Deadline hit rate", "Soft misses", "Hard misses",
                 "Spend against budget", "Most recent runs", "The selector's weights per kind of job", DAG_A, DAG_B):
        assert text in signed_in.text, text
    assert signed_in.svg_count == CHARTS


def test_the_screenshot_is_the_full_page_and_not_blank(signed_in):
    image = Image.open(io.BytesIO(signed_in.png))
    assert image.format == "PNG" and image.size == (WIDTH, signed_in.height)
    assert signed_in.height > 1800  # cards, four charts and two tables, one under another
    pixels = np.asarray(image.convert("RGB"), dtype=float)
    inked = (pixels.min(axis=2) < 200).mean()  # share of pixels darker than the white background
    assert 0.02 < inked < 0.6
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # anti-aliased text and coloured charts
    assert pixels.std() > 20


def test_a_user_of_one_dag_sees_only_it_in_the_browser(chromium, fleet_url, tmp_path):
    alice = capture_page(chromium, fleet_url, tmp_path / "profile", cookies={"_token": token("viewer", "alice")},
                         width=WIDTH)
    assert DAG_A in alice.text and DAG_B not in alice.text
    assert alice.svg_count == CHARTS


def test_without_the_cookie_the_browser_gets_no_fleet(chromium, fleet_url, tmp_path):
    anonymous = capture_page(chromium, fleet_url, tmp_path / "profile", width=WIDTH)
    assert "Not authenticated" in anonymous.text
    assert anonymous.svg_count == 0 and "USD" not in anonymous.text
