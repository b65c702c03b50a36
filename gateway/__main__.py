"""``specdec gateway`` / ``python -m gateway``: the gateway alone, against running draft/target services."""

from gateway.config import ENV_PREFIX, GatewayConfig
from specdec.serving.settings import service_cli

add_arguments, run, main = service_cli(GatewayConfig, ENV_PREFIX, "gateway.server:create_server", "gateway")

if __name__ == "__main__":
    main()
