"""vllm_patching.compat against the vLLM installed in this venv (CI runs it on 0.26.0 and 0.32.0)."""

import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from example_trainer.bridges import bridge_class
from example_trainer.modes import MODES
from vllm_patching import compat

pytestmark = pytest.mark.every_vllm


@pytest.mark.parametrize("text, expected", [
    ("0.26.0", (0, 26, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.33.0rc1.dev5+g1234", (0, 33, 0)), ("1.2", (1, 2, 0)),
])
def test_parse_version(text, expected):
    assert compat.parse_version(text) == expected


def test_parse_version_refuses_what_is_no_version():
    with pytest.raises(ValueError, match="cannot read a vLLM version"):
        compat.parse_version("dev")


def test_the_installed_vllm_is_a_tested_one():
    assert ".".join(map(str, compat.vllm_version())) in compat.TESTED_VERSIONS


def test_entry_points_resolve_on_the_installed_vllm():
    make_arg_parser, validate = compat.serve_parser_functions()
    assert callable(make_arg_parser) and callable(validate)
    server = compat.server_entry_points()
    for name in ("setup_server", "build_async_engine_client", "build_app", "init_app_state", "serve_http"):
        assert callable(getattr(server, name)), name
    error = compat.error_response_type()
    assert {"error"} <= set(error.model_fields)
    assert callable(compat.authentication_middleware_type().verify_token)


def test_vllm_answers_its_client_mistakes_and_a_dead_engine_but_not_its_empty_generate_error():
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    answered = compat.errors_vllm_answers()
    assert issubclass(VLLMValidationError, (*answered, ValueError))  # a ValueError is answered 400 by the route
    assert issubclass(EngineDeadError, answered) and not issubclass(EngineGenerateError, answered)


def test_waiting_queues_are_the_real_schedulers_attributes():
    """Both queues exist on the installed vLLM's Scheduler (checked on its source: they are set in __init__)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    fake = SimpleNamespace(waiting=["a"], skipped_waiting=["b"], kv_holding_waiting=["b"])
    queues = compat.waiting_queues(fake)
    assert [list(q) for q in queues] == [["a"], ["b"]]
    init = inspect.getsource(Scheduler.__init__)
    names = ("waiting", "kv_holding_waiting") if compat.has_launchers() else ("waiting", "skipped_waiting")
    for name in names:
        assert f"self.{name} =" in init, name


def test_no_cpu_weight_packing_switches_both_checks_off_and_back():
    import vllm._custom_ops as ops
    import vllm.model_executor.layers.utils as layer_utils

    before = ops._supports_onednn, layer_utils.check_cpu_sgl_kernel
    with compat.no_cpu_weight_packing():
        assert ops._supports_onednn is False
        assert layer_utils.check_cpu_sgl_kernel(4096, 4096, None) is False
    assert (ops._supports_onednn, layer_utils.check_cpu_sgl_kernel) == before


def test_native_kv_release_is_there_exactly_where_compat_says():
    from vllm import LLM

    assert hasattr(LLM, "release_kv_cache_memory") == compat.has_native_kv_release()


@pytest.mark.parametrize("mode", [name for name, mode in MODES.items() if not mode.in_process])
def test_the_flags_each_mode_starts_vllm_with_parse_on_the_installed_vllm(mode, tmp_path):
    """What launch_inference and a restart pass to the vLLM server, through the installed vLLM's own
    serve parser and validation (the modes' loops run end to end on one vLLM version only)."""
    from example_trainer.bridges.lora import lora_module_args
    from example_trainer.config import TrainerConfig
    from example_trainer.engine.vllm_process import vllm_server_args
    from vllm_patching.api_server import parse_args

    bridge, lora = bridge_class(mode), MODES[mode].lora
    # A CPU trainer: server mode on a GPU machine needs a second GPU for vLLM, refused at config
    # time on one GPU (a refusal tests/unit/test_vllm_gpus.py covers); the flags are the machine's.
    cfg = TrainerConfig(weight_bridge_mode=mode, device="cpu", **({"lora_r": 8} if lora else {}))
    adapter = lora_module_args("policy-0a1b2c-step-1", tmp_path) if lora else []  # lora_restart's restarts
    args = parse_args(["--model", str(tmp_path), *vllm_server_args(cfg), *bridge.vllm_args(cfg), *adapter])
    assert args.max_model_len == cfg.seq_len
    if torch.cuda.is_available():  # the machine's own flags reached vLLM's parser
        assert args.gpu_memory_utilization == cfg.vllm_memory_fraction()
    else:
        assert args.enforce_eager
    if lora:
        assert args.enable_lora and args.max_lora_rank >= 8
        assert [m.path for m in args.lora_modules] == [json.loads(adapter[1])["path"]]


def test_routed_experts_come_from_the_aux_output_connector_exactly_where_compat_says():
    import importlib.util

    assert (importlib.util.find_spec("vllm.distributed.aux_output_connector") is not None) == \
        compat.routes_by_aux_output()
    if not compat.routes_by_aux_output():  # 0.26: its CPU experts pick their own routes, which it does not capture
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        assert "select_experts(" in inspect.getsource(CPUFusedMOE.__call__)
        assert "UnquantizedMoeBackend.CPU" in inspect.getsource(UnquantizedFusedMoEMethod.is_monolithic.fget)


def test_routing_replays_flags_parse_and_add_the_route_capture_where_vllm_needs_it(tmp_path):
    from example_trainer.config import TrainerConfig
    from example_trainer.engine.vllm_process import vllm_server_args
    from vllm_patching.api_server import ROUTES_EXTENSION, parse_args

    argv = ["--model", str(tmp_path), *vllm_server_args(TrainerConfig(routing_replay=True))]
    args = parse_args(argv)
    assert args.enable_return_routed_experts
    assert args.worker_extension_cls == ("" if compat.routes_by_aux_output() else ROUTES_EXTENSION)
    if not compat.routes_by_aux_output():
        with pytest.raises(SystemExit, match="conflicts with --enable-return-routed-experts"):
            parse_args([*argv, "--worker-extension-cls", "some.other.Extension"])


def test_the_per_engine_utility_call_compat_uses_is_on_the_installed_vllm():
    """compat.collective_rpc_per_engine calls each data-parallel engine through vLLM's private
    ``_call_utility_async(method, *args, engine=...)``: a vLLM that renames or reshapes it must
    fail here, not in a server-mode run with --vllm-data-parallel-size."""
    from vllm.v1.engine import core_client

    parameters = inspect.signature(core_client.DPLBAsyncMPClient._call_utility_async).parameters
    assert list(parameters)[:2] == ["self", "method"] and "engine" in parameters
    assert parameters["engine"].kind is inspect.Parameter.KEYWORD_ONLY
