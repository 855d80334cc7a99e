"""Running untrusted Python in a child process (used by the code reward and the python tool alike):
:mod:`.runner` starts and watches the child, :mod:`.plan` picks the isolation settings this machine
allows, :mod:`.child` is the child's bootstrap."""
