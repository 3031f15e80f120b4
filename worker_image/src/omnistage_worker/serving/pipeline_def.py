"""What a pipeline is to the router: its stages in order and what each passes to the next.

Pure parsing of ``--pipeline NAME=STAGE:PASSES,...,STAGE`` (the chart renders it from an
OmniPipeline's spec): ``PASSES`` is ``embeds`` (the stage runs as a text encoder, its hidden
states become the next stage's ``prompt_embeds``) or ``text`` (its generated text becomes the
next stage's prompt); the last stage makes the pipeline's output and passes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Passes", "PipelineDef", "PipelineStage", "parse_pipeline"]

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_STAGES = 8


class Passes(StrEnum):
    """What a stage hands the next one."""

    EMBEDS = "embeds"
    TEXT = "text"


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline (``passes`` None: the last, which answers)."""

    name: str
    passes: Passes | None = None


@dataclass(frozen=True)
class PipelineDef:
    """A pipeline served under ``name``."""

    name: str
    stages: tuple[PipelineStage, ...]

    @property
    def last(self) -> PipelineStage:
        return self.stages[-1]


def parse_pipeline(text: str) -> PipelineDef:
    """``NAME=STAGE:PASSES,...,STAGE`` (ValueError naming what is wrong)."""
    name, sep, rest = text.partition("=")
    usage = "use NAME=STAGE:embeds,STAGE (or STAGE:text)"
    if not sep or not _NAME.match(name):
        raise ValueError(f"--pipeline {text!r}: {usage}")
    items = rest.split(",")
    if not 2 <= len(items) <= MAX_STAGES:
        raise ValueError(f"--pipeline {text!r}: 2 to {MAX_STAGES} stages, got {len(items)}")
    stages: list[PipelineStage] = []
    for i, item in enumerate(items):
        stage, colon, passes = item.partition(":")
        if not _NAME.match(stage):
            raise ValueError(f"--pipeline {text!r}: {stage!r} is not a stage name")
        last = i == len(items) - 1
        if last:
            if colon:
                raise ValueError(f"--pipeline {text!r}: the last stage passes nothing on")
            stages.append(PipelineStage(stage))
            continue
        try:
            stages.append(PipelineStage(stage, Passes(passes)))
        except ValueError:
            raise ValueError(
                f"--pipeline {text!r}: stage {stage!r} must say what it passes (:embeds or :text)"
            ) from None
    if len({s.name for s in stages}) != len(stages):
        raise ValueError(f"--pipeline {text!r}: a stage appears twice")
    return PipelineDef(name, tuple(stages))
