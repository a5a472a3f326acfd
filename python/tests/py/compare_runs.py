"""Compares two saved DDP runs (ddp_train.py): integer tensors must be equal, floating point
ones equal within reassociation tolerance. Prints the largest difference; exits 1 on a
mismatch.

Usage: compare_runs.py A.pt B.pt
"""

import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
assert a.keys() == b.keys(), (a.keys(), b.keys())
worst, bad = 0.0, []
for k in a:
    x, y = a[k], b[k]
    if x.dtype.is_floating_point:
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(x, y, rtol=1e-4, atol=1e-5):
            bad.append(f"{k}: max difference {diff}")
    elif not torch.equal(x, y):
        bad.append(f"{k}: integers differ: {x.tolist()} vs {y.tolist()}")
print(f"compared {len(a)} tensors; largest float difference {worst:.3g}; integer tensors equal: {not any('integers' in m for m in bad)}")
if bad:
    print("MISMATCH:\n" + "\n".join(bad))
    sys.exit(1)
print("runs match")
