"""The report page in a real browser: served by uvicorn, authenticated by the UI's cookie.

The plugin app runs behind uvicorn on 127.0.0.1 with the same Airflow auth as in the API
server; headless Chromium gets the ``_token`` cookie the Airflow UI sets on login (through the
DevTools protocol, see :mod:`tests.headless_chromium`), loads the page and takes a full-page
screenshot, which must have the page's size and not be blank. Chromium is a system package
(``apt-get install -y chromium``); without it this test fails rather than skips, so a machine
that cannot run it is noticed.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from tests.headless_chromium import PageCapture, capture_page, chromium  # noqa: F401 (a fixture)
from tests.report_airflow import DAG_ID, FINISHED_TASK, serve_over_http, serve_reports, shared_report_db, token
from tests.run_log_samples import CHARTS, POOLS, sample_result

WIDTH = 1280


@pytest.fixture(scope="module")
def report_url(tmp_path_factory) -> Iterator[str]:
    """The finished run's report page, served by uvicorn on a free local port."""
    db = shared_report_db(tmp_path_factory)
    with serve_reports(db) as host, serve_over_http(host) as base_url:
        yield f"{base_url}/spotsched/runs/{DAG_ID}/{db.run_id}/{FINISHED_TASK}"


@pytest.fixture(scope="module")
def signed_in(chromium, report_url, tmp_path_factory) -> PageCapture:
    return capture_page(chromium, report_url, tmp_path_factory.mktemp("chromium"), cookies={"_token": token("viewer")},
                        width=WIDTH)


def test_the_browser_renders_the_whole_report(signed_in):
    result = sample_result()
    assert "finished, deadline met" in signed_in.text
    assert f"{result['cost']:,.2f} USD" in signed_in.text
    assert "Cost accumulated against the on-demand line" in signed_in.text
    assert signed_in.svg_count == CHARTS + len(POOLS)


def test_the_screenshot_is_the_full_page_and_not_blank(signed_in):
    image = Image.open(io.BytesIO(signed_in.png))
    assert image.format == "PNG"
    assert image.size == (WIDTH, signed_in.height)
    assert signed_in.height > 1500  # summary, three charts and the open forecast chart, one under another
    pixels = np.asarray(image.convert("RGB"), dtype=float)
    inked = (pixels.min(axis=2) < 200).mean()  # share of pixels darker than the white background
    assert 0.03 < inked < 0.6
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # anti-aliased text and coloured charts
    assert pixels.std() > 20


def test_without_the_cookie_the_browser_gets_no_report(chromium, report_url, tmp_path):
    anonymous = capture_page(chromium, report_url, tmp_path / "profile", width=WIDTH)
    assert "Not authenticated" in anonymous.text
    assert anonymous.svg_count == 0 and "USD" not in anonymous.text
