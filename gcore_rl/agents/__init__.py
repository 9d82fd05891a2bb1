"""Agents: multi-turn, tool-using rollouts built on the rollout seam (`gcore_rl.rollout.functions`)."""
