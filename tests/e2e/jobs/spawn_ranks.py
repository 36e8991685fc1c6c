"""Start N ranks of a script directly (no torchrun), as mpirun or a cluster script would.

usage: python spawn_ranks.py N PORT script.py
"""

import os
import subprocess
import sys

n, port, script = int(sys.argv[1]), sys.argv[2], sys.argv[3]
procs = []
for r in range(n):
    env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
               LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs.append(subprocess.Popen([sys.executable, script], env=env))
codes = [p.wait() for p in procs]
sys.exit(max(abs(c) for c in codes))
