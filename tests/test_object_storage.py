"""The operator's files under ``gs://`` go through ObjectStoragePath with the connection's credentials.

A subprocess (gcsfs reads its feature switches at import, and must not probe gRPC here) builds the
operator's :func:`connection_locate` on a ``google_cloud_platform`` connection whose extras name
the project, anonymous credentials and a Cloud Storage endpoint on loopback (:mod:`tests.fake_gcs`),
while the ambient credentials point at a file that does not exist: reaching the store at all shows
the connection's settings were used, not the environment's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec

from airflow_provider_spotsched.hooks.object_storage import connection_locate

ROOT = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, sys
from airflow_provider_spotsched.hooks.object_storage import connection_locate
from airflow_provider_spotsched.runtime.contract import Progress, read_log_tail, read_progress, write_config
from tests.fake_gcs import fake_gcs

with fake_gcs() as gcs:
    extra = {"project": "project-of-the-connection", "is_anonymous": True, "gcs.endpoint": gcs.url}
    import os
    os.environ["AIRFLOW_CONN_GCP_STORE"] = json.dumps({"conn_type": "google_cloud_platform", "extra": extra})
    locate = connection_locate("gcp_store")
    uri = "gs://bucket/jobs/j1"
    fs, path = locate(uri + "/config.json")
    write_config(uri, {"samples": 64}, locate)
    gcs.objects["bucket/jobs/j1/progress.json"] = json.dumps(Progress(samples_done=32, status="running").to_dict()).encode()
    gcs.objects["bucket/jobs/j1/logs/vm-1/train.log"] = b"".join(b"line %d\n" % i for i in range(2000))
    print(json.dumps({
        "fs": type(fs).__name__, "path": path, "project": fs.project,
        "config": json.loads(gcs.objects["bucket/jobs/j1/config.json"]),
        "samples_done": read_progress(uri, locate).samples_done,
        "tail": read_log_tail(uri, "vm-1", max_bytes=40, locate=locate),
        "authorizations": sorted(set(map(str, gcs.authorizations))),
    }))
"""


def test_gs_files_are_reached_with_the_connection_not_ambient_credentials(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "no-such-key.json"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["fs"] == "GCSFileSystem" and seen["path"] == "bucket/jobs/j1/config.json"
    assert seen["project"] == "project-of-the-connection"
    assert seen["config"] == {"samples": 64} and seen["samples_done"] == 32
    assert seen["tail"] == "line 1997\nline 1998\nline 1999\n"  # from the first whole line of the last 40 bytes
    assert seen["authorizations"] == ["None"]  # the connection's anonymous credentials, no ambient token


def test_local_paths_keep_fsspec_and_need_no_connection(tmp_path):
    fs, path = connection_locate("no_such_connection")(str(tmp_path / "progress.json"))
    assert isinstance(fs, fsspec.implementations.local.LocalFileSystem) and path == str(tmp_path / "progress.json")
