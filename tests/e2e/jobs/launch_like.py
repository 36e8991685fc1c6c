"""Start N ranks of a script the way srun or mpirun does on one node: every task in its own
process group, with the launcher's identity variables and no RANK; SIGINT and SIGTERM are
forwarded to every task, and the launcher exits when all have, with the worst exit code.

usage: python launch_like.py slurm|ompi N PORT script.py [ARGS...]
"""

import os
import signal
import subprocess
import sys

style, n, port, script, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], \
    sys.argv[5:]
procs: list[subprocess.Popen] = []


def forward(sig: int, _frame: object) -> None:
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, sig)


signal.signal(signal.SIGINT, forward)
signal.signal(signal.SIGTERM, forward)
for r in range(n):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    env.pop("RANK", None)
    if style == "slurm":
        env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(n), SLURM_LOCALID=str(r),
                   SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NNODES="1")
    else:
        env.update(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE=str(n),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE=str(n))
    procs.append(subprocess.Popen([sys.executable, script, *args], env=env, process_group=0))
codes = [p.wait() for p in procs]
sys.exit(max((abs(c) for c in codes), default=0))
