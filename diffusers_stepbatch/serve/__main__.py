"""`python -m diffusers_stepbatch.serve [flags]`: see `diffusers_stepbatch.serve.cli`."""

from .cli import serve_main

if __name__ == "__main__":
    serve_main()
