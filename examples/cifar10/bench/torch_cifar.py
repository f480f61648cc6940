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
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, lrn=True):
        super().__init__()
        self.lrn = lrn
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.local3 = nn.Linear(6 * 6 * 64, 384)
        self.local4 = nn.Linear(384, 192)
        self.softmax_linear = nn.Linear(192, 10)
        # TF: out = in / (1 + 0.001/9 * sum_{9 channels} in^2)^0.75;
        # torch divides alpha by size, so alpha = 0.001/9 * 9.
        self.norm = nn.LocalResponseNorm(size=9, alpha=0.001, beta=0.75, k=1.0)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        # TF SAME max-pool k3 s2 (24->12, 12->6) pads one column/row at the
        # end only: that is ceil_mode=True with no padding.
        x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        if self.lrn:
            x = self.norm(x)
        x = F.relu(self.conv2(x))
        if self.lrn:
            x = self.norm(x)
        x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        x = torch.flatten(x, 1)
        x = F.relu(self.local3(x))
        x = F.relu(self.local4(x))
        return self.softmax_linear(x)


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
        loss = F.cross_entropy(logits, y)
        # TF tutorial weight decay on the two hidden FC layers
        loss = loss + 0.004 * 0.5 * (net.local3.weight.pow(2).sum() +
                                     net.local4.weight.pow(2).sum())
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
