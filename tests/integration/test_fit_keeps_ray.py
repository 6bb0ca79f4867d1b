"""`distrain.fit` in a fresh process (a notebook, a script): the local Ray it starts stays up for the next
fit, whose workers are the first one's, warm; a fit that needs more CPUs than it has starts it over,
bigger; at exit it is stopped like a run's own Ray (no process left, its leftover marker removed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from distrain.orchestrator import leftovers

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray
    import distrain
    from distrain.orchestrator import cluster, warm_pool

    root = sys.argv[1]
    small = dict(model="mlp", epochs=1, max_steps=4, eval_every=0, progress=False)
    distrain.fit(workers=2, run_dir=f"{root}/first", **small)
    first = {"up": ray.is_initialized(), "cpus": ray.cluster_resources()["CPU"], "session": cluster._session_dir()}
    distrain.fit(workers=2, run_dir=f"{root}/second", **small)
    second = {"taken": warm_pool.taken(), "session": cluster._session_dir()}
    bigger = (os.cpu_count() or 1) + 1  # more workers than the kept Ray's CPUs: it starts over
    distrain.fit(workers=bigger, run_dir=f"{root}/bigger", **small)
    third = {"cpus": ray.cluster_resources()["CPU"], "session": cluster._session_dir(), "workers": bigger}
    print(json.dumps({"first": first, "second": second, "third": third}))
    """
)


def test_fit_keeps_the_ray_it_started_for_the_next_fit_and_stops_it_at_exit(tmp_path):
    script = tmp_path / "fits.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    first, second, third = seen["first"], seen["second"], seen["third"]
    assert first["up"]  # still running after the first fit returned
    assert second["session"] == first["session"] and second["taken"] == 2  # the same Ray, the same two workers
    assert third["session"] != first["session"] and third["cpus"] >= third["workers"]
    # Both Rays are gone with the process, the kept one stopped by distrain (its marker removed).
    for session in {first["session"], third["session"]}:
        assert not (Path(session) / leftovers.MARKER).exists(), session
        deadline = time.time() + 10
        while leftovers.session_processes([Path(session)]):
            assert time.time() < deadline, leftovers.session_processes([Path(session)])
            time.sleep(0.5)
