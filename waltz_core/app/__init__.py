"""Ready-made applications on top of the client library.

* :mod:`.up` - ``waltz up``: a whole local cluster with one command;
* :mod:`.bank` - ``waltz demo bank``: the original's demo bank (balances in SQLite, exactly-once);
* :mod:`.validate` - ``waltz client validate``: the original's optimistic-locking validation;
* :mod:`.quickstart` - ``waltz demo quickstart``: README command 1 (``./demo.sh``).
"""
