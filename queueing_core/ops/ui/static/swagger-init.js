// Swagger UI over the ops API's document; a file of its own because the pages allow no inline script.
window.addEventListener("DOMContentLoaded", function () {
  var el = document.getElementById("swagger");
  SwaggerUIBundle({
    url: el.dataset.openapi,
    dom_id: "#swagger",
    deepLinking: true,
    // the session cookie goes with every request; changes also need the anti-forgery token
    requestInterceptor: function (req) {
      req.headers["X-CSRF-Token"] = el.dataset.csrf;
      req.headers["X-Requested-With"] = "XMLHttpRequest";
      return req;
    },
  });
});
