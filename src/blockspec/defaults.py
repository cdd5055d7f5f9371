"""The defaults `blockspec generate` and `blockspec.load` share (no heavy imports: the CLI
reads them before it loads anything)."""

DEFAULT_BLOCK_SIZE = 16  # the most tokens (anchor + drafts) a step verifies, where the drafter allows
# token trees of at most this many drafted nodes per step, the planner choosing how many
# (on this CPU with the shipped drafter, docs/benchmarks.md: tree tau ~1.45x chain tau)
DEFAULT_TREE_BUDGET = 32
# the precisions a trained drafter may compute in (`targets.loading.drafter_dtype` resolves auto)
DRAFTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
