"""`ray: null` means a new local Ray, always (issue 17 item 5): a stale `ray_current_cluster` file left by
another Ray session must not be joined."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import json, ray
    from mesh.control.ray_connect import connect_ray
    from mesh.control.mesh_config import RayConfig
    owned = connect_ray(RayConfig(), num_cpus=2)
    try:
        ctx = ray.get_runtime_context()
        print(json.dumps({"owned": owned, "gcs": ctx.gcs_address,
                          "cpus": ray.cluster_resources().get("CPU")}))
    finally:
        ray.shutdown()
""")


def test_null_address_starts_its_own_loopback_ray_despite_a_stale_cluster_file(tmp_path: Path) -> None:
    # Ray looks for `<RAY_TMPDIR>/ray/ray_current_cluster`; leave a stale one there, as a crashed session would
    ray_tmp = Path("/tmp") / f"wm-ray-{os.getpid()}"  # short: Ray's socket paths must stay under 107 bytes
    (ray_tmp / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # nothing listens there
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    finally:
        subprocess.run(["rm", "-rf", str(ray_tmp)], check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["owned"] is True
    assert not got["gcs"].endswith(":9"), got  # its own GCS, not the stale address
    assert got["cpus"] == 2.0
