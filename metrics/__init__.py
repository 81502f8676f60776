"""Pure numerics on arrays: errors, Bhattacharyya coefficient, KV comparison, logit validation,
verdicts. No I/O and no engine imports: numpy/torch in, numbers out."""
