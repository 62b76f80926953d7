"""A pipeline whose own `__call__` makes torch raise (and catch) C++ exceptions between its model calls, as
transformers' processors do: concurrent requests through the generic program finish, exact. Run in a child
process, because the failure this guards against is a crash of the whole process (a C++ backtrace walked
off a resumed greenlet's stack)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import torch
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
    from diffusers_stepbatch import StepBatched

    torch.set_num_threads(1)


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.linear(x) * t[:, None]


    class Pipe(DiffusionPipeline):
        def __init__(self, unet, scheduler):
            super().__init__()
            self.register_modules(unet=unet, scheduler=scheduler)

        @torch.no_grad()
        def __call__(self, num_inference_steps=3, generator=None):
            self.scheduler.set_timesteps(num_inference_steps)
            x = torch.randn(1, 4, generator=generator)
            for t in self.scheduler.timesteps:
                "<|image_pad|>" * torch.tensor(3)  # torch raises a C++ TypeError, Python falls back to __index__
                x = x - 0.1 * self.unet(x, t.float().expand(1) / 1000)
            return x


    torch.manual_seed(0)
    pipe = Pipe(Net(), FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    kwargs = [dict(num_inference_steps=2 + i % 5) for i in range(8)]
    expected = [pipe(**k, generator=torch.Generator().manual_seed(i)) for i, k in enumerate(kwargs)]
    with StepBatched(pipe, max_batch_size=8) as sb:
        for _ in range({rounds}):
            handles = [sb.submit(**k, generator=torch.Generator().manual_seed(i)) for i, k in enumerate(kwargs)]
            got = [handle.result(60) for handle in handles]
            assert max(float((g - e).abs().max()) for g, e in zip(got, expected)) <= 1e-6
        assert max(sb.stats()["rows_histogram"]["denoise"]) > 1
    print("done")
''')


def test_cpp_exceptions_inside_pipeline_calls_neither_crash_nor_change_outputs():
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(rounds=10)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("done"), (result.returncode,
                                                                               result.stderr[-2000:])
