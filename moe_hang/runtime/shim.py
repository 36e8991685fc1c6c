"""watch's ``torchrun`` shim: the probe survives a launch script that sets PYTHONPATH itself.

``moe-hang watch`` puts the probe into every rank through a ``sitecustomize`` on PYTHONPATH. A
launch script that assigns PYTHONPATH (``export PYTHONPATH=$PWD/src``) drops it. So watch also
puts a directory of its own first on the job's PATH, holding one ``torchrun``: it puts the
probe's directory back in front of whatever PYTHONPATH the script set (only when watch's
probe variables are still there, and only once), then ``exec``\\ s the next ``torchrun`` on PATH
— the one the script would have run — with the same arguments. Nothing else changes.

What still drops the probe (``watch`` then watches by sampling, README): ``env -i`` or a
script that resets PATH; ``python -m torch.distributed.run`` or a launcher other than
``torchrun`` after PYTHONPATH was replaced; ``python -I``, ``-E`` (PYTHONPATH ignored) or
``-S`` (no site import); a venv activated after a replaced PYTHONPATH puts its own
``torchrun`` first; a container or a remote host started from the script.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_SITE = "MOE_HANG_PROBE_SITE"  # the probe's sitecustomize directory
ENV_SHIM = "MOE_HANG_SHIM_DIR"  # this directory, skipped when looking for the real torchrun

# POSIX sh: the job's own Python is not known yet, and no Python need be on PATH
SCRIPT = """#!/bin/sh
# moe-hang watch: put the probe back on PYTHONPATH (a launch script may have replaced it),
# then run the next torchrun on PATH with the same arguments (moe_hang/runtime/shim.py).
if [ -n "${MOE_HANG_PROBE_DIR:-}" ] && [ -n "${MOE_HANG_PROBE_SITE:-}" ]; then
  case ":${PYTHONPATH:-}:" in
    *":$MOE_HANG_PROBE_SITE:"*) ;;
    *) PYTHONPATH="$MOE_HANG_PROBE_SITE${PYTHONPATH:+:$PYTHONPATH}"; export PYTHONPATH ;;
  esac
fi
set -f
IFS=:
for d in $PATH; do
  [ -n "$d" ] || continue
  [ "$d" = "${MOE_HANG_SHIM_DIR:-}" ] && continue
  [ "$d/torchrun" -ef "$0" ] && continue
  if [ -f "$d/torchrun" ] && [ -x "$d/torchrun" ]; then
    unset IFS
    set +f
    exec "$d/torchrun" "$@"
  fi
done
echo "moe-hang: no torchrun on PATH" >&2
exit 127
"""


def install(bin_dir: Path) -> Path:
    """Write the shim into ``bin_dir`` (private, 0700) and return the directory."""
    bin_dir.mkdir(mode=0o700, exist_ok=True)
    path = bin_dir / "torchrun"
    tmp = bin_dir / ".torchrun.tmp"
    tmp.write_text(SCRIPT)
    tmp.chmod(0o700)
    os.replace(tmp, path)
    return bin_dir


def env_for(bin_dir: Path, site: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the shim first on PATH and the variables it reads."""
    out = dict(env)
    path = out.get("PATH", os.defpath)
    out["PATH"] = str(bin_dir) + (os.pathsep + path if path else "")
    out[ENV_SITE] = str(site)
    out[ENV_SHIM] = str(bin_dir)
    return out
