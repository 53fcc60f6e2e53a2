"""onecopy's vLLM server, as people start it (the server itself is ``vllm_patching/api_server.py``):

    onecopy-vllm --model PATH [--port 9001] [any vLLM serve flag]
    python -u example_trainer/vllm_api_server.py --model PATH ...      # Atropos's recipe
    python -m example_trainer.vllm_api_server --model PATH ...

``--model default`` serves onecopy's default model (``example_trainer.default_model``), which the
code that vLLM loads does not import.
"""

from example_trainer.default_model import default_model_path
from vllm_patching import api_server


def main(argv: list[str] | None = None) -> None:
    """Run onecopy's vLLM server; ``--model default`` is the default model's local folder."""
    api_server.main(argv, default_model=default_model_path)


if __name__ == "__main__":
    main()
