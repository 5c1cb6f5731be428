"""A cheap frontend check of a constraint, so a bad one is a ValueError before it reaches the core.

The frontend does not know the core's backend, so a constraint passes when either compiler takes it
(auto's rule); a core set to one backend may still refuse it, with an error output for that request.
llguidance checks without a tokenizer in ~1 ms and imports fast; xgrammar (a ~3 s import) is only
asked about what llguidance refuses.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

from vllm_lite.sampling_params import StructuredOutputsParams
from vllm_lite.structured_output.backend_types import GrammarCompileError
from vllm_lite.structured_output.spec import GrammarSpec, spec_from_params


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError with the compilers' messages if no backend can compile `params`."""
    error = _check(spec_from_params(params))
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=256)
def _check(spec: GrammarSpec) -> Optional[str]:
    guidance_error = _guidance_error(spec)
    if guidance_error is None:
        return None
    xgrammar_error = _xgrammar_error(spec)
    if xgrammar_error is None:
        return None
    return f"invalid {spec.field}: xgrammar: {xgrammar_error}; guidance: {guidance_error}"


def _guidance_error(spec: GrammarSpec) -> Optional[str]:
    from vllm_lite.structured_output.backend_guidance import check_guidance_grammar, guidance_grammar

    try:
        check_guidance_grammar(guidance_grammar(spec), None)
    except (GrammarCompileError, ValueError, TypeError) as e:
        return str(e)
    return None


def _xgrammar_error(spec: GrammarSpec) -> Optional[str]:
    """xgrammar's parse of the constraint alone (no tokenizer needed)."""
    import xgrammar as xgr

    from vllm_lite.structured_output.backend_xgrammar import (
        choice_as_ebnf,
        compile_structural_tag,
        compiler_message,
        unenforced_schema_message,
    )

    if spec.whitespace_pattern is not None:
        return "xgrammar does not support whitespace_pattern"
    unenforced = unenforced_schema_message(spec)
    if unenforced is not None:
        return unenforced
    try:
        if spec.kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(choice_as_ebnf(json.loads(spec.text)))
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "structural_tag":
            compile_structural_tag(xgr, xgr.Grammar.from_structural_tag, spec.text)
    except (RuntimeError, ValueError, TypeError) as e:
        return compiler_message(e)
    return None
