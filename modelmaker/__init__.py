"""modelmaker: development tooling that makes models — random-weight OPT and Llama-family checkpoints in Hugging
Face layout (opt_checkpoint.py, llama_checkpoint.py, sharing hf_files.py), the tiny model's tokenizer
(tiny_tokenizer.py) and the built-in tiny model (tiny_model.py).

Used by server.py (building the tiny model for `--model tiny-opt`), the `fastserve` commands (make-model, the
simulator's shapes) and the tests. The engine, scheduler, memory, kernels and serving packages never import it:
they load models; making them is the commands' (tests/test_package_boundaries.py checks this).
"""
