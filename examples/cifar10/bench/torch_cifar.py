#!/usr/bin/python3
"""PyTorch reference of the CIFAR-10 tutorial CNN (examples/cifar10/nn.h):
the same network, eager float32 on the CPU or (--device cuda) a GPU, SGD,
synthetic data. Prints one JSON line: {"images_per_sec": ..., "threads": T, ...}.

On the GPU it is strict float32 like the C backend's cuBLAS calls: TF32
off for cuDNN convolutions and for matmuls (PyTorch enables it for cuDNN
by default); cudnn.benchmark on (PyTorch's fastest eager setting). The
clock is read after torch.cuda.synchronize(), so queued work is counted.

usage: torch_cifar.py [--device cpu|cuda] [--threads T] [--batch B] [--steps N]
                      [--warmup W] [--no-lrn]
"""
import argparse
import json
import os
import sys
import time

import torch

# The network is the Python examples' (examples/python/cifar_net.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from cifar_net import Net, loss as cifar_loss  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-lrn", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    if a.device == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
    net = Net(lrn=not a.no_lrn).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(a.batch, 3, 24, 24, device=dev)
    y = torch.randint(0, 10, (a.batch,), device=dev)

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = net(x)
        loss = cifar_loss(net, logits, y)  # with the tutorial's weight decay
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    dt = time.perf_counter() - t0
    out = {"images_per_sec": a.batch * a.steps / dt,
           "threads": a.threads, "batch": a.batch,
           "lrn": 0 if a.no_lrn else 1, "ms_per_step": 1e3 * dt / a.steps,
           "loss": float(loss), "impl": "torch-" + torch.__version__,
           "device": a.device}
    if a.device == "cuda":
        out["device_name"] = torch.cuda.get_device_name(0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
