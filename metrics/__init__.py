"""Pure numerics on arrays: errors, Bhattacharyya coefficient, KV comparison, logit validation,
verdicts. No I/O and no engine imports: numpy/torch in, numbers out."""
from .bc import bhattacharyya_batched, bhattacharyya_coefficient
from .errors import cosine, rel_l2, rel_linf
from .kv import (
    HeadMetrics,
    KVComparison,
    KVRawErrors,
    TokenKVErrors,
    TokenKVMetrics,
    aggregate_kv_bc_across_prompts,
    aggregate_kv_bc_arrays,
    compare_kv_caches,
    compute_combined_bc_per_layer,
)
from .logits import (
    DEFAULT_TOLERANCE_MAP,
    LogitValidationResult,
    ThreeWayTokenMetrics,
    TokenLogitResult,
    ValidationStatus,
    logit_validation,
    validate_logits,
    validate_token_logits,
)
from .verdict import (
    KVVerdict,
    KVVerdictConfig,
    LogitVerdict,
    aggregate_kv_verdict,
    aggregate_logit_verdict,
)

__all__ = [
    "KVVerdict", "KVVerdictConfig", "LogitVerdict", "aggregate_kv_verdict", "aggregate_logit_verdict",
    "DEFAULT_TOLERANCE_MAP", "LogitValidationResult", "ThreeWayTokenMetrics", "TokenLogitResult",
    "ValidationStatus", "logit_validation", "validate_logits", "validate_token_logits",
    "bhattacharyya_batched", "bhattacharyya_coefficient", "cosine", "rel_l2", "rel_linf",
    "HeadMetrics", "KVComparison", "KVRawErrors", "TokenKVErrors", "TokenKVMetrics",
    "aggregate_kv_bc_across_prompts", "aggregate_kv_bc_arrays", "compare_kv_caches",
    "compute_combined_bc_per_layer",
]
