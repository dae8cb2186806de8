"""Execution on the nodes of a Ray cluster (``gpusched run --ray``).

``driver`` connects to the cluster, starts one ``agent`` per node (a Ray actor
pinned to its node), checks that every node has the same code, and carries the
driver's decisions to the agents and their results back; ``watchdog`` cleans a
node up if its agent dies. The decisions themselves are made by the pure
``gpusched.scheduling.cluster``. Only this package imports Ray, and only when
``--ray`` is given.
"""
