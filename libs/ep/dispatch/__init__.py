"""EP dispatch/combine: the interface (base.py), one module per backend (all_to_all.py, deepep.py,
mooncake_ep.py), and the choice by name in one place (factory.py)."""
