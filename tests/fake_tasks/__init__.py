"""Tiny programs that stand in for TF tasks in supervisor tests, and the helpers that run them."""
