// Starts Swagger UI on /docs (templates/api_docs.html) for the app's OpenAPI schema.
window.SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  deepLinking: true,
  presets: [window.SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
