"""Model adapters: one protocol (encode → run with interventions → AttentionResult) per model family."""
