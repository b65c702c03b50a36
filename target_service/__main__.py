"""``specdec target-service`` / ``python -m target_service``: the target service alone (what a container runs).

Health says NOT_SERVING until the model is loaded and warmed up.
"""

from specdec.settings import service_cli
from target_service.config import ENV_PREFIX, TargetServiceConfig

add_arguments, run, main = service_cli(TargetServiceConfig, ENV_PREFIX, "target_service.server:create_server_async",
                                       "target-service")

if __name__ == "__main__":
    main()
