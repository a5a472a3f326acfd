"""numpy allreduce with lightpath under any launcher lightpath.init() understands.

    mpirun -n 2 python3 examples/numpy_allreduce.py          # (as root: --allow-run-as-root)
    python3 -m torch.distributed.run --nproc_per_node 2 --redirects 1 --tee 1 --standalone examples/numpy_allreduce.py
"""

import numpy as np

import lightpath

comm = lightpath.init()
x = np.arange(8, dtype=np.float64) + comm.rank
comm.allreduce(x)  # in place, sum over ranks
expected = sum(np.arange(8, dtype=np.float64) + r for r in range(comm.size))
assert np.array_equal(x, expected)
print(f"rank {comm.rank} of {comm.size} over {comm.transports()}: {x}")
