"""What a speculative step proposes before the policy verifies: strategy names and the rollout-history index."""
