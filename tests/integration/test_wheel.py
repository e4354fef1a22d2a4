"""A wheel of crane-mp (which ships the web pages' files), installed into a fresh virtual environment
outside the repository, builds and loads its native kernels (every source and header ships) for the
lowest CPU tier, into the cache entry the repository's own code names for that tier, also past the lock
file of a build that was killed. (One tier: every source and header compiles in each; a build takes a
minute on two cores. The entry is the shared cache's, as for every other test: CI's second pass, capped
to that tier, then loads it instead of building it again.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from crane_mp.worker.kernels.cpu_isa import host_isa
from crane_mp.worker.kernels.loader import build_name, compiler_identity, kernel_cache_dir

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, torch, crane_mp
from crane_mp.worker.platforms import platform_for
tiers = platform_for("cpu").describe()  # builds the kernels
argmax = torch.ops.crane_mp.argmax_rows(torch.tensor([[1.0, 3.0, 2.0]])).tolist()
print(json.dumps({"file": crane_mp.__file__, "tiers": tiers, "argmax": argmax}))
"""


@pytest.mark.skipif(host_isa() is None or compiler_identity() is None, reason="no native kernels on this host")
def test_installed_wheel_builds_its_kernels_per_tier(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(REPO)], check=True, cwd=tmp_path)
    [wheel] = (tmp_path / "dist").glob("crane_mp-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    pages = {f"crane_mp/frontend/webui/static/{p.name}" for p in (REPO / "crane_mp/frontend/webui/static").iterdir()}
    assert pages <= shipped, pages - shipped  # the web pages ship with the package
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    # torch and the other dependencies come from the environment running this test (a virtual one, as
    # most users run it, whose packages --system-site-packages would not see), after the wheel's own
    # site-packages; its .pth files are not read from there, so its editable crane_mp stays out.
    [site] = (venv / "lib").glob("python*/site-packages")
    (site / "outer-environment.pth").write_text("\n".join(_site_dirs()) + "\n")

    tiers = ["avx2"]
    entry = kernel_cache_dir() / build_name(tiers[0], *compiler_identity())
    # A build killed half-way leaves torch's lock file behind; the next start must not wait on it forever.
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "lock").touch()
    for tier in tiers:
        env = {**os.environ, "CRANE_MP_ISA": tier}
        env.pop("CRANE_MP_NO_NATIVE_KERNELS", None)
        out = subprocess.run([str(python), "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert Path(report["file"]).is_relative_to(venv), report["file"]
        assert report["tiers"] == [tier, tier], out.stderr
        assert report["argmax"] == [1]
    assert (entry / f"{entry.name}.so").exists() and not (entry / "lock").exists()  # the wheel's build: the same name


def _site_dirs() -> list[str]:
    """This environment's site-packages directories (where torch is installed)."""
    import site

    return [path for path in site.getsitepackages() if Path(path).is_dir()]
