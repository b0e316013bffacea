"""The engine's messages are typed records: no free-form dicts, enums that still read as their strings."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields

from conveyor.engine.loop import LoopState
from conveyor.engine.messages import EngineFailed, EngineReady, FailedAdd, LoopOutput
from conveyor.outputs import FinishReason, StepDelta
from conveyor.request import EngineRequest
from conveyor.sampling_params import ParamError, SamplingParams


def test_step_delta_and_loop_output_have_no_free_form_dicts() -> None:
    for cls in (StepDelta, LoopOutput, EngineRequest, FailedAdd, EngineReady, EngineFailed):
        loose = [f.name for f in fields(cls) if str(f.type).replace(" ", "") in ("dict", "dict|None")]
        assert not loose, (cls.__name__, loose)


def test_enums_serialize_as_todays_strings() -> None:
    assert json.dumps({"finish_reason": FinishReason.STOP}) == '{"finish_reason": "stop"}'
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert [str(s) for s in LoopState] == ["ran", "held", "idle", "stopped"]
    assert FinishReason.LENGTH == "length" and pickle.loads(pickle.dumps(FinishReason.ABORT)) is FinishReason.ABORT


def test_a_bad_parameter_carries_its_name() -> None:
    try:
        SamplingParams(min_tokens=5, max_tokens=2)
    except ParamError as e:
        assert e.param == "min_tokens" and str(e).startswith("min_tokens ")
    else:
        raise AssertionError("no error")
    try:
        SamplingParams(logit_bias={70000: 1.0}).check_vocab(1000)
    except ParamError as e:
        assert e.param == "logit_bias"
    else:
        raise AssertionError("no error")
