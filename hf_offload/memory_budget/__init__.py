"""The memory budget: per decoder layer, the cheapest way to keep a training step's peak under the user's budget.

Its modules are imported by their own names; this package imports none of them, so that a module of the pure part
loads without the torch-heavy ones.
"""

__all__: list[str] = []
