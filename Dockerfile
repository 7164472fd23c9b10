# compactor in a container: built from this source, run as a non-root user
# with the store on the /data volume.
#
#   docker build -t compactor .
#   docker run -p 8787:8787 -v compactor-data:/data \
#     -e COMPACTOR_UPSTREAM=https://api.openai.com/v1 compactor
#
# Inside the container the proxy listens on 0.0.0.0:8787, so /admin/ needs a
# token ([admin] token_env in a mounted config); `docker exec CONTAINER
# compactor conversations list` reads the store without one.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin compactor \
 && strip target/release/compactor

FROM debian:bookworm-slim
# ca-certificates: TLS to the upstream; curl: the health check.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin compactor \
 && mkdir -p /data && chown compactor:compactor /data
COPY --from=build /src/target/release/compactor /usr/local/bin/compactor
COPY proxy.toml /etc/compactor/proxy.toml
USER compactor
WORKDIR /data
VOLUME ["/data"]
ENV COMPACTOR_CONFIG=/etc/compactor/proxy.toml \
    COMPACTOR_LISTEN=0.0.0.0:8787 \
    COMPACTOR_DB=/data/compactor.db
EXPOSE 8787
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8787/healthz || exit 1
ENTRYPOINT ["compactor"]
CMD ["serve"]
