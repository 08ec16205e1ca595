"""Tree search: the tree that decodes fastest on this machine for a drafter (Hydra app; config: conf/eval.yaml).

    python -m eval.tree_search drafter.path=runs/<run>/drafter                      # budget=auto: time, keep fastest
    python -m eval.tree_search drafter.path=... tree_search.budget=16 tree_search.out=trees/h16.json   # Medusa heads
    python -m eval.evaluate drafter.path=... tree=trees/h16.json ...                # use it

The work is `medusa_like.apps.tree_search` (installed as `medusa-tree-search`); this file keeps the command working
from the checkout.
"""

from medusa_like.apps.tree_search import main, tree_search

__all__ = ["main", "tree_search"]

if __name__ == "__main__":
    main()
