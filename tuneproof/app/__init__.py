"""The application: the `tuneproof` command line, its terminal display, the embedded local cluster,
and `lint`. It may import everything below it (flows, tasks, tuneproof.control, tuneproof.core);
nothing imports it back.
"""
