"""A configuration-driven training framework built around a fully sharded data-parallel engine."""
