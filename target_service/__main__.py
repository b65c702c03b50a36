"""``specdec target-service`` / ``python -m target_service``: the target service alone (what a container runs).

Health says NOT_SERVING until the model is loaded and warmed up.
"""

from specdec.serving.backend_service import backend_service_cli
from target_service.config import ENV_PREFIX, TargetServiceConfig

add_arguments, run, main = backend_service_cli(TargetServiceConfig, ENV_PREFIX, "target_service.server:create_server",
                                               "target-service")

if __name__ == "__main__":
    main()
