"""The served model names: ``GET /v1/models`` and the ``model`` check.

A request naming no served model gets 404 ``model_not_found`` with
``param: "model"``, as OpenAI and vLLM answer: clients (the official one's
``NotFoundError``) tell a missing model from a malformed request by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from vllm.entrypoints.openai.errors import OpenAIError
from vllm.entrypoints.openai.protocol import ModelCard, ModelList


@dataclass(frozen=True)
class OpenAIServingModels:
    names: list[str]  # any of them is a valid "model"
    root: str  # the checkpoint directory
    max_model_len: int

    def list_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.root, max_model_len=self.max_model_len)
                for name in self.names
            ]
        )

    def check(self, name: str | None) -> None:
        """Raise unless ``name`` is served (None: the request may omit it)."""
        if name is not None and name not in self.names:
            raise OpenAIError(
                f"model: the model `{name}` does not exist (served: "
                f"{', '.join(self.names)})",
                param="model",
                status=HTTPStatus.NOT_FOUND,
                code="model_not_found",
            )
