"""Failure signatures are pure functions: one cause reads as one line, whatever ids, paths and numbers differ."""

from __future__ import annotations

from shared.results.signatures import (
    error_signature,
    fail_signature,
    innermost_frame,
    module_of,
    normalise,
    signature_id,
)

SITE = "/opt/venv/lib/python3.11/site-packages"

# A chained traceback as traceback.format_exc() prints it: the cause first, then the exception raised, whose
# message ends with the user code dynamo was tracing.
TRACE = f'''Traceback (most recent call last):
  File "{SITE}/torch/_dynamo/exc.py", line 727, in unimplemented
    raise Unsupported(msg, gb_type, skip_frame)
torch._dynamo.exc.Unsupported: Data-dependent branching

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/work/main/services/runner/tasks/text_generation.py", line 88, in accelerator
    out = generate()
  File "{SITE}/transformers/generation/utils.py", line 3236, in _sample
    outputs = model_forward(**model_inputs, return_dict=True)
  File "{SITE}/torch/_dynamo/symbolic_convert.py", line 1200, in step
    self.dispatch_table[inst.opcode](self, inst)
  File "/work/main/services/runner/faults.py", line 12, in wrapped
    return fn(*args)
torch._dynamo.exc.Unsupported: Data-dependent branching

from user code:
   File "{SITE}/transformers/models/mistral/modeling_mistral.py", line 159, in forward
    if attention_mask.sum() > 0:
'''


def test_messages_differing_in_ids_paths_numbers_and_addresses_give_one_signature() -> None:
    first = (
        "RuntimeError: tensor at 0x7f3a2c0b1d20 in /tmp/run-abc123/job-17/model.safetensors has 4096 rows, "
        "expected 11008 (request 3f2b8c1e-1d2a-4c3b-9e8f-0a1b2c3d4e5f, commit 1a2b3c4d5e6f7a8b, dir tmpk2j9x_ab)"
    )
    second = (
        "RuntimeError: tensor at 0x55d1e2f3a4b0 in /data/artifacts/job-902/model.safetensors has 512 rows, "
        "expected 1376 (request 9d8c7b6a-5f4e-4d3c-8b2a-1f0e9d8c7b6a, commit ffee0011aabbccdd, dir tmpq8w7e6r5)"
    )
    assert (
        normalise(first)
        == normalise(second)
        == (
            "RuntimeError: tensor at <addr> in <path> has <n> rows, expected <n> "
            "(request <uuid>, commit <id>, dir <tmp>)"
        )
    )
    assert error_signature("load", first, TRACE) == error_signature("load", second, TRACE)


def test_the_models_own_id_and_urls_are_stripped_so_forty_models_read_as_one() -> None:
    a = error_signature(
        "download", "org-a/model-1@main: 404 for url http://hub/api/models/org-a/model-1", "", "org-a/model-1"
    )
    b = error_signature(
        "download", "acme/Big-7B@main: 404 for url https://hf.co/api/models/acme/Big-7B", "", "acme/Big-7B"
    )
    assert a == b and a.text == "ERROR(download): <model>@main: <n> for url <url>"


def test_numbers_that_name_something_stay() -> None:
    """A compiler error code, a dtype and a rank's name are part of the cause, not a count."""
    assert (
        normalise("NCC_EVRF007: float32 op on rank1 failed 3 times")
        == "NCC_EVRF007: float32 op on rank1 failed <n> times"
    )
    assert error_signature("compile", "NCC_EVRF007: x").id != error_signature("compile", "NCC_EVRF009: x").id
    below = "BackendCompilerFailed: the neuron compiler failed: RuntimeError: exit status 70\n[NCC_ITEN404] at 12"
    assert error_signature("compile", below).text == (
        "ERROR(compile): BackendCompilerFailed: the neuron compiler failed: RuntimeError: exit status <n> [NCC_ITEN404]"
    )


def test_different_exception_types_and_classes_give_different_signatures() -> None:
    base = error_signature("runtime", "RuntimeError: shapes do not match", TRACE)
    assert error_signature("runtime", "ValueError: shapes do not match", TRACE).id != base.id
    assert error_signature("compile", "RuntimeError: shapes do not match", TRACE).id != base.id
    assert error_signature("runtime", "RuntimeError: shapes do not match").id != base.id  # no frame
    assert len(base.id) == 16 and base.id == signature_id(base.text)


def test_the_innermost_frame_inside_torch_or_transformers_is_picked() -> None:
    # the user-code frame dynamo appended is innermost; our own runner's frames are never picked
    assert innermost_frame(TRACE) == "transformers.models.mistral.modeling_mistral:forward"
    without_user_code = TRACE.split("\nfrom user code:")[0]
    assert innermost_frame(without_user_code) == "torch._dynamo.symbolic_convert:step"
    assert innermost_frame('  File "/work/main/services/runner/child.py", line 3, in main\n') is None
    assert error_signature("compile", "Unsupported: Data-dependent branching", TRACE).text == (
        "ERROR(compile): Unsupported: Data-dependent branching @ transformers.models.mistral.modeling_mistral:forward"
    )


def test_module_names_come_from_installed_and_source_checkouts() -> None:
    assert module_of(f"{SITE}/torch/_dynamo/convert_frame.py") == "torch._dynamo.convert_frame"
    assert module_of(f"{SITE}/torch_neuronx/xla_impl/__init__.py") == "torch_neuronx.xla_impl"
    assert module_of("/src/transformers/src/transformers/cache_utils.py") == "transformers.cache_utils"
    assert module_of(f"{SITE}/numpy/core/fromnumeric.py") is None
    assert module_of("/work/main/services/runner/stages.py") is None


def test_a_fail_reads_as_the_rule_that_failed_it() -> None:
    a = fail_signature("prefill logits differ from the reference by 0.0412 (relative; tolerance 0.001)")
    b = fail_signature("prefill logits differ from the reference by 7.5e-02 (relative; tolerance 0.05)")
    assert a == b and a.text == "FAIL: prefill logits differ from the reference by <n> (relative; tolerance <n>)"
    judged = fail_signature("the local judge finds the sharded output not fluent: repeats 'the the the'")
    other = fail_signature("the local judge finds the sharded output not fluent: it is gibberish\nand more")
    assert judged == other and judged.text == "FAIL: the local judge finds the sharded output not fluent"
    assert fail_signature("the accelerator produced non-finite logits").id != a.id
