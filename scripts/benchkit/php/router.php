<?php

/**
 * scripts/bench's web tier router (`php -S ... router.php`): Phorge's rewrite rule, and
 * /__bench/opcache, whether the serving worker's opcache is on, so the bench can check it.
 */
$path = parse_url($_SERVER['REQUEST_URI'], PHP_URL_PATH);
if ($path === '/__bench/opcache') {
  header('Content-Type: application/json');
  $status = function_exists('opcache_get_status') ? @opcache_get_status(false) : false;
  echo json_encode(array(
    'enabled' => is_array($status) && !empty($status['opcache_enabled']),
  ));
  return true;
}
$_GET['__path__'] = $path;
$_REQUEST['__path__'] = $path;
// Cluster mode insists on it; php -S does not set it.
if (!isset($_SERVER['SERVER_ADDR'])) {
  $_SERVER['SERVER_ADDR'] = '127.0.0.1';
}
require getenv('PHORGE_WEBROOT').'/index.php';
