"""Start N ranks of a script the way srun or mpirun does on one node: every task in its own
process group, with the launcher's identity variables and no RANK; SIGINT and SIGTERM are
forwarded to every task, and the launcher exits when all have, with the worst exit code.

usage: python launch_like.py slurm|ompi N PORT script.py [ARGS...]

Once per "node" for a job over several (LAUNCH_NODE_RANK=K, LAUNCH_NNODES=M): the tasks of
node K, global ranks K*N .. K*N+N-1 of M*N, as srun's or mpirun's daemon on that node starts
them (MASTER_ADDR:PORT is rank 0's store, on node 0). Slurm says how many tasks a node runs
only where --ntasks-per-node was given: not here.
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
node = int(os.environ.get("LAUNCH_NODE_RANK", "0"))
nnodes = int(os.environ.get("LAUNCH_NNODES", "1"))
for r in range(n):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    env.pop("RANK", None)
    g, size = node * n + r, nnodes * n
    if style == "slurm":
        env.update(SLURM_PROCID=str(g), SLURM_NTASKS=str(size), SLURM_LOCALID=str(r),
                   SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NNODES=str(nnodes),
                   SLURM_NODEID=str(node))
    else:
        env.update(OMPI_COMM_WORLD_RANK=str(g), OMPI_COMM_WORLD_SIZE=str(size),
                   OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE=str(n))
    procs.append(subprocess.Popen([sys.executable, script, *args], env=env, process_group=0))
codes = [p.wait() for p in procs]
sys.exit(max((abs(c) for c in codes), default=0))
