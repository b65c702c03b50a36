"""``specdec draft-service`` / ``python -m draft_service``: the draft service alone (what a container runs).

Health says NOT_SERVING until the model is loaded and warmed up.
"""

from draft_service.config import ENV_PREFIX, DraftServiceConfig
from specdec.serving.backend_service import backend_service_cli

add_arguments, run, main = backend_service_cli(DraftServiceConfig, ENV_PREFIX, "draft_service.server:create_server",
                                               "draft-service")

if __name__ == "__main__":
    main()
