"""onecopy's vLLM server, as people start it (the server itself is ``vllm_patching/api_server.py``):

    onecopy-vllm --model PATH [--port 9001] [any vLLM serve flag]
    python -u example_trainer/vllm_api_server.py --model PATH ...      # Atropos's recipe
    python -m example_trainer.vllm_api_server --model PATH ...

``--model default`` serves onecopy's default model (``example_trainer.model.default_model``), which the
code that vLLM loads does not import.
"""

from example_trainer.model.default_model import default_model_path
from vllm_patching.engine_fork import prepare_fork


def main(argv: list[str] | None = None) -> None:
    """Run onecopy's vLLM server; ``--model default`` is the default model's local folder."""
    prepare_fork()  # this is the server process: before vLLM and transformers load (engine_fork.py says why)
    from vllm_patching import api_server

    api_server.main(argv, default_model=default_model_path)


if __name__ == "__main__":
    main()
