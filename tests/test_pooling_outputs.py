"""The task views of a pooling result (outputs.py's from_base): EmbeddingRequestOutput, ClassificationRequestOutput
and ScoringRequestOutput carry the base output's request id, prompt token ids, finished flag and prompt, and turn
its tensor into the task's output, refusing a tensor of the wrong shape with a message that names it."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)


def _base(data: torch.Tensor) -> PoolingRequestOutput:
    return PoolingRequestOutput("req-7", PoolingOutput(data), [5, 6, 7], True, prompt="hi", error=None)


@pytest.mark.parametrize(
    ("view", "output", "data", "expected"),
    [
        (EmbeddingRequestOutput, EmbeddingOutput, torch.tensor([0.5, -1.0, 2.0]), EmbeddingOutput([0.5, -1.0, 2.0])),
        (
            ClassificationRequestOutput,
            ClassificationOutput,
            torch.tensor([0.25, 0.75]),
            ClassificationOutput([0.25, 0.75]),
        ),
        (ScoringRequestOutput, ScoringOutput, torch.tensor([0.125]), ScoringOutput(0.125)),
    ],
    ids=["embed", "classify", "score"],
)
def test_a_task_view_keeps_the_request_fields_and_converts_the_output(view, output, data, expected) -> None:
    got = view.from_base(_base(data))
    assert type(got) is view and type(got.outputs) is output
    assert got.outputs == expected
    assert (got.request_id, got.prompt_token_ids, got.finished, got.prompt) == ("req-7", [5, 6, 7], True, "hi")
    assert got.error is None


def test_task_outputs_report_their_sizes() -> None:
    assert EmbeddingOutput.from_base(PoolingOutput(torch.zeros(4))).hidden_size == 4
    assert ClassificationOutput.from_base(PoolingOutput(torch.zeros(3))).num_classes == 3
    assert ScoringOutput.from_base(PoolingOutput(torch.tensor([[2.5]]))).score == 2.5  # any one-number shape


@pytest.mark.parametrize(
    ("output", "data", "message"),
    [
        (EmbeddingOutput, torch.zeros(2, 3), "an embedding must be a vector, got a tensor of shape (2, 3)."),
        (EmbeddingOutput, torch.tensor(1.0), "an embedding must be a vector, got a tensor of shape ()."),
        (ClassificationOutput, torch.zeros(1, 2), "class scores must be a vector, got a tensor of shape (1, 2)."),
        (ScoringOutput, torch.zeros(2), "a score must be one number, got a tensor of shape (2,)."),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_refused_with_its_message(output, data, message) -> None:
    with pytest.raises(ValueError) as e:
        output.from_base(PoolingOutput(data))
    assert str(e.value) == message
