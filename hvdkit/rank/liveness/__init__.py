"""Whether the ranks and their launcher are alive, each watch for one way of going: a rank that
makes no progress or whose peer is gone (watchdog, with each rank's stacks: stacks), a launcher
gone from this host (orphan), horovodrun --gloo's launcher gone from another (lifeline), and the
line to hvdkit launch --max-restarts (link)."""
