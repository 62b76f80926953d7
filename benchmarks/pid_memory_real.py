"""Activation peaks of the real pair's stages at real widths, at small sizes on this CPU (float32), to extrapolate.

    python benchmarks/pid_memory_real.py vae 512      # FLUX.1's VAE decoding a 64 x 64 latent to 512 px
    python benchmarks/pid_memory_real.py pid 512      # the released flux PiD (all 14 + 2 blocks), one forward, 512 px
    python benchmarks/pid_memory_real.py flux 1024    # FLUX.1-dev's transformer, 1 double + 1 single block, 1024 px

Weights are filled with N(0, 0.02) (values do not move memory); the peak is the high-water mark of live tensor
bytes during the forward (`torch.profiler`, profile_memory), inputs and weights excluded (allocated before). A
transformer forward frees each block's activations before the next, so one block of each kind gives its peak.
Convolution and attention activations grow linearly with pixels here (two sizes per stage check it).
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch.profiler import profile, ProfilerActivity
import pid_scaled

torch.set_num_threads(1)


def live_peak(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.no_grad():
            out = fn()  # noqa: F841 (kept alive until the profile ends: its bytes count)
    ev = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nb in ev:
        live += nb
        peak = max(peak, live)
    return peak / 2**20


def fill(m):
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m.eval()


which = sys.argv[1]
size = int(sys.argv[2])
t0 = time.time()
if which == "vae":
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(**pid_scaled.REAL_FLUX_VAE)
    vae = fill(vae.to_empty(device="cpu"))
    z = torch.randn(1, 16, size // 8, size // 8)
    peak = live_peak(lambda: vae.decode(z).sample)
elif which == "pid":
    from diffusers_stepbatch.decoders.pid import PiDDecoder
    from diffusers_stepbatch.decoders.pid.configs import get_official_config

    cfg = dict(get_official_config(pid_scaled.PID_CHECKPOINT).constructor)
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else cfg["patch_depth"]
    cfg["patch_depth"] = depth
    with torch.device("meta"):
        net = PiDDecoder(**cfg)
    net = fill(net.to_empty(device="cpu"))
    x = torch.randn(1, 3, size, size)
    lat = torch.randn(1, 16, size // 32, size // 32)
    txt = torch.randn(1, 300, 2304)
    peak = live_peak(lambda: net(x, torch.full((1,), 500.0), txt, lq_latent=lat, degrade_sigma=torch.full((1,), 0.2)))
elif which == "flux":
    from diffusers import FluxTransformer2DModel

    cfg = dict(pid_scaled.REAL_FLUX_TRANSFORMER, num_layers=1, num_single_layers=1)
    with torch.device("meta"):
        tr = FluxTransformer2DModel(**cfg)
    tr = fill(tr.to_empty(device="cpu"))
    n = (size // 16) ** 2
    hs = torch.randn(1, n, 64)
    enc = torch.randn(1, 512, 4096)
    img_ids = torch.zeros(n, 3)
    txt_ids = torch.zeros(512, 3)
    peak = live_peak(
        lambda: (
            tr(
                hidden_states=hs,
                encoder_hidden_states=enc,
                pooled_projections=torch.randn(1, 768),
                timestep=torch.full((1,), 0.5),
                guidance=torch.full((1,), 3.5),
                img_ids=img_ids,
                txt_ids=txt_ids,
            ).sample
        )
    )
print(json.dumps(dict(which=which, size=size, peak_mib=peak, seconds=time.time() - t0, argv=sys.argv[1:])))
