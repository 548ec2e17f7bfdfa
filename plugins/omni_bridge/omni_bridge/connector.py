"""ARToDiffusionConnector: the AR stage's supplemental guidance plus the user's request -> a diffusion input."""

from __future__ import annotations

from typing import Any

import attrs

from omni_kernel import Request, StageInput, StageOutput

from .guidance import CONTRACT, GUIDANCE_FIELD, parse_guidance

GUIDANCE_HEADER = "Supplemental guidance: "


def merge_prompt(prompt: str, guidance: str | None) -> str:
    """The user's prompt stays first and whole; guidance, when there is any, follows as its own paragraph."""
    return f"{prompt}\n\n{GUIDANCE_HEADER}{guidance}" if guidance else prompt


@attrs.frozen
class ARToDiffusionConnector:
    """Turns an `ar.prompt_bridge` output into the diffusion stage's input. It converts and nothing else: the
    StageScheduler gives the input the diffusion node's own params. It reads the output's typed fields (text, stop
    reason, contract, the constraint it was decoded under), never the AR stage's trace."""

    name: str = "ar_to_diffusion"
    source_kind: str = "ar"
    target_kind: str = "diffusion"
    source_contract: str = CONTRACT  # the graph builder checks the source node type's output_contract against it
    strategy: str = "append"
    field: str = GUIDANCE_FIELD
    extra_fields: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def convert(self, output: StageOutput, request: Request) -> StageInput:
        guidance = parse_guidance(output.text, output.stop_reason, output.contract, self.field, self.extra_fields)
        prompt = merge_prompt(request.prompt, guidance.text)
        trace: dict[str, Any] = {
            "diffusion.bridge": self.name,
            "diffusion.source_node": output.node_id,
            "diffusion.source_request_id": output.request_id,
            "diffusion.bridge_strategy": self.strategy,
            "diffusion.bridge_constrained": output.structured is not None,
            "diffusion.bridge_parse_success": guidance.ok,
            "diffusion.bridge_fallback": not guidance.ok,
            "diffusion.bridge_fallback_reason": guidance.reason,
            "diffusion.ar_guidance_prompt": guidance.text,
            "diffusion.prompt": prompt,
        }
        return StageInput(request_id=request.request_id, prompt=prompt, image=request.image, trace=trace)
