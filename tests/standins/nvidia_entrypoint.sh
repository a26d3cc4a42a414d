#!/bin/sh
# The stand-in image's /opt/nvidia/nvidia_entrypoint.sh: NGC's prints a banner and runs its arguments.
[ "$#" -gt 0 ] || set -- /bin/sh
exec "$@"
